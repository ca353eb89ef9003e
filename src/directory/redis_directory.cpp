#include "directory/redis_directory.hpp"

#if SLUICE_HAVE_REDIS

#include <hiredis/hiredis.h>

#include <mutex>
#include <vector>

#include "sluice/error.hpp"

namespace sluice::detail {
namespace {

using Clock = StoreBackend::Clock;

// KEYS[1] the key; ARGV[1] our last value, ARGV[2] the new value, ARGV[3] the TTL in ms.
constexpr const char* kUpdateScript =
    "local v = redis.call('GET', KEYS[1]) "
    "if v == ARGV[1] or v == ARGV[2] then redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3]) return 1 end "
    "return 0";
// KEYS[1]; ARGV[1] our value, ARGV[2] the TTL in ms.
constexpr const char* kKeepScript =
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end return 0";
// KEYS[1]; ARGV[1] our value.
constexpr const char* kRemoveScript =
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0";

struct ReplyDeleter {
  void operator()(redisReply* r) const { freeReplyObject(r); }
};
using Reply = std::unique_ptr<redisReply, ReplyDeleter>;

struct ContextDeleter {
  void operator()(redisContext* c) const { redisFree(c); }
};
using Context = std::unique_ptr<redisContext, ContextDeleter>;

timeval to_timeval(std::chrono::milliseconds ms) {
  ms = std::max(ms, std::chrono::milliseconds(1));
  return {static_cast<time_t>(ms.count() / 1000), static_cast<suseconds_t>((ms.count() % 1000) * 1000)};
}

class RedisBackend final : public StoreBackend {
 public:
  explicit RedisBackend(RedisServer s) : s_(std::move(s)), where_(s_.host + ":" + std::to_string(s_.port)) {}

  std::optional<std::string> create(const std::string& key, const std::string& value, Clock::time_point deadline) override {
    const std::string ttl = std::to_string(s_.ttl.count());
    // Remembered before the SET: if its reply is lost, remove() can still take back exactly
    // this value (the scripts act only on a key that holds it, so nothing else is touched).
    remember(value);
    Reply r = command(deadline, {"SET", key, value, "NX", "PX", ttl});
    if (r->type == REDIS_REPLY_STATUS) return std::nullopt;
    auto holder = get(key, deadline);
    // Our own SET landed but its reply was lost (the connection failed and command() retried):
    // the key holds exactly our value, so it is ours.
    if (holder && *holder == value) {
      remember(value);
      return std::nullopt;
    }
    return holder ? *holder : std::string("{}");  // expired in between: held by nobody we can name
  }

  bool update(const std::string& key, const std::string& value, Clock::time_point deadline) override {
    std::string mine = current();
    if (mine.empty()) return false;
    Reply r = command(deadline, {"EVAL", kUpdateScript, "1", key, mine, value, std::to_string(s_.ttl.count())});
    if (integer(r) != 1) return false;
    remember(value);
    return true;
  }

  bool keep_alive(const std::string& key, Clock::time_point deadline) override {
    std::string mine = current();
    if (mine.empty()) return false;
    return integer(command(deadline, {"EVAL", kKeepScript, "1", key, mine, std::to_string(s_.ttl.count())})) == 1;
  }

  std::optional<std::string> get(const std::string& key, Clock::time_point deadline) override {
    Reply r = command(deadline, {"GET", key});
    if (r->type == REDIS_REPLY_NIL) return std::nullopt;
    if (r->type != REDIS_REPLY_STRING) throw Error(ErrorCode::kProtocol, "redis " + where_ + ": GET returned no string");
    return std::string(r->str, r->len);
  }

  void remove(const std::string& key, Clock::time_point deadline) override {
    std::string mine = current();
    if (mine.empty()) return;
    command(deadline, {"EVAL", kRemoveScript, "1", key, mine});
    remember("");
  }

 private:
  std::string current() {
    std::lock_guard<std::mutex> lk(mine_mu_);
    return mine_;
  }
  void remember(const std::string& v) {
    std::lock_guard<std::mutex> lk(mine_mu_);
    mine_ = v;
  }

  int64_t integer(const Reply& r) const {
    if (r->type != REDIS_REPLY_INTEGER) throw Error(ErrorCode::kProtocol, "redis " + where_ + ": a script returned no integer");
    return r->integer;
  }

  Context connect(Clock::time_point deadline) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) throw Error(ErrorCode::kTimeout, "redis " + where_ + ": no time left to connect");
    Context c(redisConnectWithTimeout(s_.host.c_str(), s_.port, to_timeval(left)));
    if (!c) throw Error(ErrorCode::kSystem, "redis " + where_ + ": out of memory for a context");
    if (c->err) throw Error(ErrorCode::kSystem, "redis " + where_ + ": " + c->errstr);
    if (!s_.password.empty()) run(c.get(), deadline, {"AUTH", s_.password}, "AUTH");
    if (s_.db != 0) run(c.get(), deadline, {"SELECT", std::to_string(s_.db)}, "SELECT");
    return c;
  }

  // One command on `c`; a server error reply is kRemoteError naming `what`.
  Reply run(redisContext* c, Clock::time_point deadline, const std::vector<std::string>& args, const char* what) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) throw Error(ErrorCode::kTimeout, "redis " + where_ + ": no time left for " + what);
    redisSetTimeout(c, to_timeval(left));
    std::vector<const char*> argv;
    std::vector<size_t> lens;
    for (const auto& a : args) {
      argv.push_back(a.data());
      lens.push_back(a.size());
    }
    Reply r(static_cast<redisReply*>(redisCommandArgv(c, static_cast<int>(argv.size()), argv.data(), lens.data())));
    if (!r) throw Error(ErrorCode::kSystem, "redis " + where_ + ": " + what + ": " + (c->err ? c->errstr : "no reply"));
    if (r->type == REDIS_REPLY_ERROR)
      throw Error(ErrorCode::kRemoteError, "redis " + where_ + " refused " + what + ": " + std::string(r->str, r->len));
    return r;
  }

  // Runs `args` on an idle connection (or a new one); a connection that failed is dropped.
  // A pooled connection may be dead (the server restarted since it was last used): then the
  // other idle ones are too, and the command is tried once more on a fresh connection.
  // Every command we send is safe to repeat (GET, the compare-and-act scripts, SET NX, whose
  // repeat create() recognises by its value).
  Reply command(Clock::time_point deadline, const std::vector<std::string>& args) {
    Context c;
    {
      std::lock_guard<std::mutex> lk(pool_mu_);
      if (!idle_.empty()) {
        c = std::move(idle_.back());
        idle_.pop_back();
      }
    }
    const bool pooled = static_cast<bool>(c);
    if (!c) c = connect(deadline);
    Reply r;
    try {
      r = run(c.get(), deadline, args, args[0].c_str());
    } catch (const Error& e) {
      if (e.code() == ErrorCode::kRemoteError && !c->err) {
        give(std::move(c));
        throw;
      }
      if (!pooled || Clock::now() >= deadline) throw;
      {
        std::lock_guard<std::mutex> lk(pool_mu_);
        idle_.clear();
      }
      c = connect(deadline);
      r = run(c.get(), deadline, args, args[0].c_str());
    }
    give(std::move(c));
    return r;
  }
  void give(Context c) {
    std::lock_guard<std::mutex> lk(pool_mu_);
    idle_.push_back(std::move(c));
  }

  RedisServer s_;
  std::string where_;
  std::mutex mine_mu_;
  std::string mine_;  // the value we last wrote: what the scripts compare against
  std::mutex pool_mu_;
  std::vector<Context> idle_;
};

}  // namespace

std::unique_ptr<StoreBackend> make_redis_backend(RedisServer server) {
  return std::make_unique<RedisBackend>(std::move(server));
}

}  // namespace sluice::detail

#endif  // SLUICE_HAVE_REDIS
