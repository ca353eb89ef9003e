#!/usr/bin/env python3
"""Writes the seed corpus of the fuzz targets (tests/fuzz/corpus/<target>/): valid and
near-valid bootstrap messages and frame streams, built with the header checks exactly as
docs/wire-protocol.md defines them. Rerun after a wire change; the files are committed.

    python3 tests/fuzz/make_corpus.py
"""
import json
import os
import shutil
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
M64 = (1 << 64) - 1
K = 0x9E3779B97F4A7C15


# ------------------------------------------------------------------ bootstrap messages

def bootstrap_check(magic, version, kind, length):
    x = ((magic << 32) ^ (version << 16) ^ kind ^ (length << 24)) & M64
    return ((x * K) & M64) >> 32


def msg(kind, body, *, magic=0x42434C53, version=2, length=None, check=None):
    text = body if isinstance(body, bytes) else json.dumps(body, separators=(",", ":")).encode()
    n = len(text) if length is None else length
    c = bootstrap_check(magic, version, kind, n) if check is None else check
    return struct.pack("<IHHII", magic, version, kind, n, c) + text


INFO = {"sluice": 2, "engine_id": "9f0c1d2e3f405162", "host_id": "fuzz/boot",
        "listen": "127.0.0.1:40123", "transports": {"tcp": {}},
        "regions": [{"id": 1, "addr": 140000000000, "length": 4096, "location": "host", "name": "kv"},
                    {"id": 2, "addr": 140000004096, "length": 64, "location": "host", "name": "", "shareable": True}]}


def with_info(**changes):
    info = json.loads(json.dumps(INFO))
    for k, v in changes.items():
        if v is None:
            info.pop(k, None)
        else:
            info[k] = v
    return info


def bootstrap_seeds():
    hello = {"info": INFO, "token": 1234, "transport": "tcp", "channels": 2}
    s = {
        "info_query": msg(1, {}),
        "hello": msg(2, hello),
        "channel": msg(3, {"token": 1234, "index": 0, "transport": "tcp"}),
        "reply_info": msg(4, {"info": INFO}),
        "reply_empty": msg(4, {}),
        "error": msg(5, {"code": 10, "message": "refused"}),
        "error_code_string": msg(5, {"code": "ten", "message": 5}),
        "error_code_huge": msg(5, {"code": 2 ** 64, "message": "x"}),
        "hello_missing_fields": msg(2, {"token": 1}),
        "hello_token_types": msg(2, dict(hello, token=-1, channels=2 ** 63)),
        "hello_token_float": msg(2, dict(hello, token=1.5, channels="2")),
        "info_bad_pid": msg(4, {"info": with_info(pid="x")}),
        "info_bad_regions": msg(4, {"info": with_info(regions={"id": 1})}),
        "info_region_types": msg(4, {"info": with_info(regions=[{"id": -1, "addr": 2 ** 64, "length": "x",
                                                                  "location": "cuda:99", "name": 3}])}),
        "info_bad_listen": msg(4, {"info": with_info(listen="nohost")}),
        "info_port_range": msg(4, {"info": with_info(listen="h:70000")}),
        "info_leases_types": msg(4, {"info": with_info(leases=[1, 2])}),
        "info_version": msg(4, {"info": with_info(sluice=1)}),
        "info_missing": msg(4, {"info": with_info(engine_id=None)}),
        "info_not_object": msg(4, {"info": [1, 2, 3]}),
        "body_array": msg(4, b"[]"),
        "body_not_json": msg(2, b"{\"a\":"),
        "body_deep": msg(4, b"[" * 2000 + b"]" * 2000),
        "body_deep_objects": msg(4, b"{\"a\":" * 500 + b"1" + b"}" * 500),
        "short_body": msg(2, b"{}", length=100),
        "bad_magic": msg(1, {}, magic=0x12345678),
        "bad_check": msg(1, {}, check=0),
        "version_1": msg(1, {}, version=1),
        "kind_9": msg(9, {}),
        "kind_0": msg(0, {}),
        "too_long": msg(1, b"", length=(16 << 20) + 1),
        "header_only": msg(1, b"")[:10],
        "raw_info_blob": json.dumps(INFO).encode(),
    }
    return s


# ------------------------------------------------------------------ frames

WRITE, READ_REQ, READ_RESP, ACK, NACK, SEND, SEND_ACK, IMM, SEND_RTS, ERROR = range(1, 11)
PULL_WRITE, SIGNAL = 11, 12
LANE_END, IMM_PART = 1, 2
REGION = 1      # the id fuzz_frames' registry gives its one region
REGION_LEN = 4096
OWN_READ, OWN_WRITE = 1 << 32, (1 << 32) | 1  # tokens of the harness's read and write


def frame_check(hdr48, reserved):
    x = 0x243F6A8885A308D3 ^ reserved
    for (v,) in struct.iter_unpack("<Q", hdr48):
        x ^= v
        x = (x * K) & M64
        x ^= x >> 29
    return (x ^ (x >> 32)) & 0xFFFFFFFF


def frame(type_, op_id=0, region=0, offset=0, length=0, flags=0, imm=0, aux=0, status=0, payload=b"",
          *, magic=0x46434C53, reserved=0, check=None):
    h = struct.pack("<IBBHIIQQQQ", magic, type_, flags, status, imm, aux, op_id, region, offset, length)
    c = frame_check(h, reserved) if check is None else check
    return h + struct.pack("<II", reserved, c) + payload


def frame_seeds():
    p16 = bytes(range(16))
    s = {
        "write": frame(WRITE, 1, REGION, 0, 16, LANE_END, payload=p16),
        "write_no_lane_end": frame(WRITE, 1, REGION, 100, 16, payload=p16),
        "write_at_end": frame(WRITE, 2, REGION, REGION_LEN - 6, 6, LANE_END, payload=p16[:6]),
        "write_past_end": frame(WRITE, 3, REGION, REGION_LEN - 6, 16, LANE_END, payload=p16),
        "write_offset_wrap": frame(WRITE, 3, REGION, 2 ** 64 - 8, 16, LANE_END, payload=p16),
        "write_unknown_region": frame(WRITE, 4, 2, 0, 16, LANE_END, payload=p16),
        "write_zero": frame(WRITE, 5, REGION, REGION_LEN, 0, LANE_END),
        "write_imm_2_lanes": frame(WRITE, 6, REGION, 0, 8, LANE_END | IMM_PART, imm=7, aux=2, payload=p16[:8])
                             + frame(WRITE, 6, REGION, 8, 8, LANE_END | IMM_PART, imm=7, aux=2, payload=p16[8:]),
        "write_imm_1_lane": frame(WRITE, 7, REGION, 0, 4, LANE_END | IMM_PART, imm=9, aux=1, payload=p16[:4]),
        "write_imm_refused": frame(WRITE, 8, 99, 0, 4, LANE_END | IMM_PART, imm=9, aux=1, payload=p16[:4]),
        "write_aux_no_imm": frame(WRITE, 9, 99, 0, 4, LANE_END, aux=3, payload=p16[:4]),
        "write_short_payload": frame(WRITE, 10, REGION, 0, 64, LANE_END, payload=p16),
        "signal": frame(SIGNAL, 20, REGION, 8, 0, LANE_END, imm=1),
        "signal_high_half": frame(SIGNAL, 21, REGION, 0, 0, LANE_END, imm=0xFFFFFFFF, aux=7),
        "signal_misaligned": frame(SIGNAL, 22, REGION, 3, 0, LANE_END, imm=1),
        "signal_past_end": frame(SIGNAL, 23, REGION, REGION_LEN - 4, 0, LANE_END, imm=1),
        "signal_offset_wrap": frame(SIGNAL, 24, REGION, 2 ** 64 - 8, 0, LANE_END, imm=1),
        "signal_unknown_region": frame(SIGNAL, 25, 99, 0, 0, LANE_END, imm=1),
        "signal_with_payload": frame(SIGNAL, 26, REGION, 0, 8, LANE_END, imm=1, payload=p16[:8]),
        "signal_no_lane_end": frame(SIGNAL, 27, REGION, 0, 0, 0, imm=1),
        "read_req": frame(READ_REQ, 11, REGION, 0, 0, LANE_END, imm=64),
        "read_req_two": frame(READ_REQ, 12, REGION, 0, 0, 0, imm=32) + frame(READ_REQ, 12, REGION, 32, 0, LANE_END, imm=32),
        "read_req_past_end": frame(READ_REQ, 13, REGION, 4000, 0, LANE_END, imm=200),
        "read_req_aux_high": frame(READ_REQ, 14, REGION, 0, 0, LANE_END, imm=16, aux=1),
        "read_req_unknown": frame(READ_REQ, 15, 42, 0, 0, LANE_END, imm=16),
        "send": frame(SEND, 0, 0, 0, 10, payload=b"0123456789"),
        "send_three": b"".join(frame(SEND, i, 0, 0, 4, payload=b"abcd") for i in range(3)),
        "send_zero_many": b"".join(frame(SEND, i, 0, 0, 0) for i in range(80)),
        "send_out_of_order": frame(SEND, 5, 0, 0, 4, payload=b"abcd"),
        "send_huge_claim": frame(SEND, 0, 0, 0, 200 << 20),
        "ack_unknown": frame(ACK, 77, flags=LANE_END),
        "nack_unknown": frame(NACK, 77, 0, 0, 6, LANE_END, status=9, payload=b"reason"),
        "read_resp_unknown": frame(READ_RESP, 77, 0, 0, 4, LANE_END, payload=b"abcd"),
        "send_ack_unknown": frame(SEND_ACK, 0, 0, 0, 2, status=5, payload=b"no"),
        "error": frame(ERROR, 0, 0, 0, 5, status=10, payload=b"bye!!"),
        "imm_on_tcp": frame(IMM, 0, imm=5),
        "send_rts_on_tcp": frame(SEND_RTS, 0, 0x7FFF0000, 0, 0, imm=64),
        "bad_magic": frame(WRITE, 1, REGION, 0, 0, LANE_END, magic=0x11111111),
        "bad_check": frame(WRITE, 1, REGION, 0, 0, LANE_END, check=1),
        "reserved_set": frame(ACK, 1, flags=LANE_END, reserved=0xFFFFFFFF),
        "type_0": frame(0),
        "type_11": frame(11),
        "too_long": frame(WRITE, 1, REGION, 0, (1 << 31) + 1, LANE_END),
        "truncated_header": frame(WRITE, 1, REGION, 0, 16, LANE_END)[:30],
        # answers to the harness's own operations (see submit_own_ops in fuzz_frames.cpp)
        "own_read_resp": frame(READ_RESP, OWN_READ, 0, 0, 16, LANE_END, payload=p16),
        "own_read_resp_long": frame(READ_RESP, OWN_READ, 0, 0, 64, LANE_END, payload=p16 * 4),
        "own_read_resp_huge": frame(READ_RESP, OWN_READ, 0, 0, 1 << 31, LANE_END),
        "own_read_resp_no_lane_end": frame(READ_RESP, OWN_READ, 0, 0, 16, payload=p16),
        "own_read_nack": frame(NACK, OWN_READ, 0, 0, 3, LANE_END, status=3, payload=b"oor"),
        "own_write_ack": frame(ACK, OWN_WRITE, flags=LANE_END),
        "own_write_nack": frame(NACK, OWN_WRITE, 0, 0, 0, LANE_END, status=2),
        "own_write_nack_partial": frame(NACK, OWN_WRITE, 0, 0, 2, 0, status=99, payload=b"no") +
                                  frame(ACK, OWN_WRITE, flags=LANE_END),
        "own_send_ack": frame(SEND_ACK, 0),
        "own_send_ack_status": frame(SEND_ACK, 0, 0, 0, 4, status=5, payload=b"trnc"),
        "own_all": frame(READ_RESP, OWN_READ, 0, 0, 16, LANE_END, payload=p16) + frame(ACK, OWN_WRITE, flags=LANE_END)
                   + frame(SEND_ACK, 0) + frame(ACK, OWN_WRITE, flags=LANE_END),
        "send_into_recv_truncated": frame(SEND, 0, 0, 0, 100, payload=bytes(100)),
        "mixed": frame(WRITE, 1, REGION, 0, 16, LANE_END, payload=p16) + frame(READ_REQ, 2, REGION, 0, 0, LANE_END, imm=8)
                 + frame(SEND, 0, 0, 0, 3, payload=b"xyz") + frame(WRITE, 3, REGION, 4095, 2, LANE_END, payload=b"zz"),
    }
    return s


# Seeds that crash the parsers as of this writing (see README.md); they are written to
# crashes/<target>/ instead, which run.sh replays as regression inputs.
KNOWN_CRASHES = {
    "fuzz_bootstrap": {"error_code_string", "error_code_huge", "info_region_types"},
    "fuzz_frames": set(),
}


def write(target, seeds):
    d = os.path.join(HERE, "corpus", target)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    crashes = os.path.join(HERE, "crashes", target)
    n = 0
    for name, data in seeds.items():
        if name in KNOWN_CRASHES[target]:
            os.makedirs(crashes, exist_ok=True)
            path = os.path.join(crashes, "seed-" + name)
        else:
            path = os.path.join(d, name)
            n += 1
        with open(path, "wb") as f:
            f.write(data)
    print(f"{d}: {n} seeds")


if __name__ == "__main__":
    write("fuzz_bootstrap", bootstrap_seeds())
    write("fuzz_frames", frame_seeds())
