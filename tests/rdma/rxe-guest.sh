#!/usr/bin/env bash
# rxe-guest.sh - Sluice's SoftRoCE test guest: run a command inside a throw-away QEMU guest
# whose kernel has a real verbs stack (rdma_rxe device "rxe0" on a netdev with IPv4
# 10.0.0.1/24, ib_uverbs, rdma_ucm). Used by tests/rdma/run-in-guest.sh, run.sh and bench.sh;
# see docs/rdma.md.
#
# The guest boots Debian's stock kernel (package linux-image-amd64, which ships rdma_rxe)
# with a tiny busybox initramfs built here and cached in $SLUICE_RXE_CACHE
# (default ~/.cache/sluice-rxe). Its userland is the host's root filesystem shared read-only
# over virtio-9p, so host-built binaries (and rdma-core, perftest) run unchanged; the
# directories given with --share are mounted read-write at the same path.
#
# Usage:  rxe-guest.sh [options] [--] COMMAND [ARG...]
#
#   -s, --share DIR    share DIR read-write at the same path (repeatable; default: $PWD)
#   -C, --chdir DIR    working directory for COMMAND in the guest (default: $PWD)
#   -m, --mem MiB      guest memory (default 1536, env RXE_MEM)
#   -j, --cpus N       guest vCPUs (default: min(nproc,4), env RXE_CPUS)
#   -t, --timeout SEC  kill the guest after SEC seconds, exit 124 (default 900, env RXE_TIMEOUT)
#   -a, --accel A      auto | kvm | tcg (default auto, env RXE_ACCEL)
#   -n, --netdev D     dummy (default) | veth | lo | virtio (env RXE_NETDEV)
#       --mtu N        netdev MTU (1500 -> RDMA active_mtu 1024; 9000 -> 4096) (env RXE_MTU)
#       --ip A.B.C.D   IPv4 (/24) of the netdev (default 10.0.0.1; env RXE_IP_ADDR)
#       --rxe-devices N  create N SoftRoCE devices rxe0..rxe{N-1} (default 1, env RXE_DEVICES):
#                      rxe0 as above; rxe<k> (k>=1) on its own dummy netdev dummy<k> with
#                      10.0.<k>.1/24. (Two rxe devices of one guest do not talk to each other
#                      on kernel 6.1; each one's own loopback works.)
#       --socket-net listen:PORT|connect:PORT
#                      put rxe0 on a virtio NIC joined to another guest's by a QEMU socket
#                      network on the host's 127.0.0.1:PORT (implies --netdev virtio; the
#                      "listen" guest must be started first; MAC 52:54:00:00:00:<last octet
#                      of --ip>). Used by two-guests.sh. (env RXE_SOCKET_NET)
#   -e, --env N[=V]    set env var N in the guest (to V, or to its host value)
#   -q, --quiet        no harness notes on stderr
#   -v, --verbose      also print the guest kernel console at the end
#       --rebuild      rebuild the cached initramfs
#       --build-only   only install dependencies / build the initramfs
#   -h, --help
#
# Exit status: COMMAND's; 124 = timeout; 125 = the harness or guest failed.
# In the guest: root, RLIMIT_MEMLOCK unlimited, RXE_GUEST=1, RXE_DEV=rxe0, RXE_NETDEV,
# RXE_IP, RXE_GID_INDEX (index of the RoCE v2 GID ::ffff:RXE_IP), and for all devices, in
# the same order: RXE_DEVS="rxe0 rxe1 ...", RXE_NETDEVS="dummy0 dummy1 ...",
# RXE_IPS="10.0.0.1 10.0.1.1 ...", RXE_GID_INDEXES="1 1 ..." (RoCE v2 GID index of each).
#
# Under TCG (no VT-x) the guest still boots in ~3 s: the uncompressed vmlinux is booted via
# its PVH entry point, the CPU model drops ERMS/FSRM (slow "rep movsb" under TCG) and the
# ICRC uses crc32_generic.
set -euo pipefail

PROG=${0##*/}
die()  { echo "$PROG: error: $*" >&2; exit 125; }
warn() { [ "${QUIETH:-0}" = 1 ] || echo "$PROG: $*" >&2; }

SHARES=()
CHDIR=$PWD
MEM=${RXE_MEM:-1536}
nproc_=$(nproc 2>/dev/null || echo 2)
CPUS=${RXE_CPUS:-$(( nproc_ < 4 ? nproc_ : 4 ))}
TIMEOUT=${RXE_TIMEOUT:-900}
ACCEL=${RXE_ACCEL:-auto}
NETDEV=${RXE_NETDEV:-dummy}
MTU=${RXE_MTU:-}
IPADDR=${RXE_IP_ADDR:-10.0.0.1}
NDEVS=${RXE_DEVICES:-1}
SOCKNET=${RXE_SOCKET_NET:-}
VERBOSE=0
QUIETH=0
ENVS=()
REBUILD=0
BUILD_ONLY=0
CACHE=${SLUICE_RXE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/sluice-rxe}

while [ $# -gt 0 ]; do
  case $1 in
    -s|--share)   SHARES+=("$(realpath -e -- "$2")") || die "no such dir: $2"; shift 2;;
    -C|--chdir)   CHDIR=$(realpath -e -- "$2") || die "no such dir: $2"; shift 2;;
    -m|--mem)     MEM=$2; shift 2;;
    -j|--cpus)    CPUS=$2; shift 2;;
    -t|--timeout) TIMEOUT=$2; shift 2;;
    -a|--accel)   ACCEL=$2; shift 2;;
    -n|--netdev)  NETDEV=$2; shift 2;;
    --mtu)        MTU=$2; shift 2;;
    --ip)         IPADDR=$2; shift 2;;
    --rxe-devices) NDEVS=$2; shift 2;;
    --socket-net) SOCKNET=$2; shift 2;;
    -v|--verbose) VERBOSE=1; shift;;
    -q|--quiet)   QUIETH=1; shift;;
    -e|--env)     case $2 in *=*) ENVS+=("$2");; *) ENVS+=("$2=${!2-}");; esac; shift 2;;
    --rebuild)    REBUILD=1; shift;;
    --build-only) BUILD_ONLY=1; shift;;
    -h|--help)    sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0;;
    --)           shift; break;;
    -*)           die "unknown option $1 (see --help)";;
    *)            break;;
  esac
done
[ $# -gt 0 ] || [ $BUILD_ONLY = 1 ] || die "no command given (see --help)"
[ ${#SHARES[@]} -gt 0 ] || SHARES=("$PWD")
case $NETDEV in dummy|veth|lo|virtio) ;; *) die "bad --netdev $NETDEV";; esac
case $ACCEL in auto|kvm|tcg) ;; *) die "bad --accel $ACCEL";; esac
case $NDEVS in ''|*[!0-9]*) die "bad --rxe-devices $NDEVS";; esac
if [ -n "$SOCKNET" ]; then
  case $SOCKNET in listen:[0-9]*|connect:[0-9]*) ;; *) die "bad --socket-net $SOCKNET (listen:PORT or connect:PORT)";; esac
  NETDEV=virtio
fi
[ "$NDEVS" -ge 1 ] && [ "$NDEVS" -le 64 ] || die "--rxe-devices must be 1..64"

# --------------------------------------------------------------- dependencies
need_pkgs=()
command -v qemu-system-x86_64 >/dev/null || need_pkgs+=(qemu-system-x86)
[ -x /bin/busybox ] && file -L /bin/busybox 2>/dev/null | grep -q 'statically linked' \
  || need_pkgs+=(busybox-static)
command -v rdma >/dev/null            || need_pkgs+=(iproute2)
command -v ibv_devices >/dev/null     || need_pkgs+=(ibverbs-utils)
[ -e /etc/libibverbs.d/rxe.driver ]   || need_pkgs+=(rdma-core ibverbs-providers)
command -v ib_write_bw >/dev/null     || need_pkgs+=(perftest)
command -v rping >/dev/null           || need_pkgs+=(rdmacm-utils)
command -v cpio >/dev/null            || need_pkgs+=(cpio)
command -v modprobe >/dev/null        || need_pkgs+=(kmod)
command -v file >/dev/null            || need_pkgs+=(file)
ls /boot/vmlinuz-* >/dev/null 2>&1 && \
  ls /lib/modules/*/kernel/drivers/infiniband/sw/rxe/rdma_rxe.ko* >/dev/null 2>&1 \
  || need_pkgs+=(linux-image-amd64)
if [ ${#need_pkgs[@]} -gt 0 ]; then
  [ "$(id -u)" = 0 ] || die "missing packages (${need_pkgs[*]}) and not root to install them"
  warn "installing: ${need_pkgs[*]}"
  export DEBIAN_FRONTEND=noninteractive
  { apt-get install -y --no-install-recommends "${need_pkgs[@]}" >/dev/null 2>&1 ||
    { apt-get update >/dev/null && apt-get install -y --no-install-recommends "${need_pkgs[@]}" >/dev/null; }; } \
    || die "apt-get install ${need_pkgs[*]} failed"
fi

# Kernel: newest one that has both /boot/vmlinuz-V and rdma_rxe.ko.
KVER=${RXE_KVER:-}
if [ -z "$KVER" ]; then
  for v in $(ls /lib/modules | sort -V -r); do
    if [ -e "/boot/vmlinuz-$v" ] && ls /lib/modules/$v/kernel/drivers/infiniband/sw/rxe/rdma_rxe.ko* >/dev/null 2>&1; then
      KVER=$v; break
    fi
  done
fi
[ -n "$KVER" ] || die "no kernel with rdma_rxe found (install linux-image-amd64)"
BZIMAGE=/boot/vmlinuz-$KVER
[ -r "$BZIMAGE" ] || die "$BZIMAGE not readable"

# Boot the *uncompressed* vmlinux through its PVH entry point when possible:
# under TCG the in-guest xz decompression of the bzImage alone costs ~2 s.
extract_vmlinux() {  # bzImage out -> 0 if out is an ELF vmlinux
  local img=$1 out=$2 spec name magic cmd off
  for spec in 'xz|\xfd\x37\x7a\x58\x5a\x00|xz -dc' 'zstd|\x28\xb5\x2f\xfd|zstd -qdc' \
              'gzip|\x1f\x8b\x08|gzip -dc' 'lz4|\x02\x21\x4c\x18|lz4 -dc'; do
    IFS='|' read -r name magic cmd <<<"$spec"
    command -v "${cmd%% *}" >/dev/null || continue
    for off in $(LC_ALL=C grep -obUaP "$magic" "$img" 2>/dev/null | cut -d: -f1 | head -n 5); do
      { tail -c +$((off + 1)) "$img" | $cmd > "$out.tmp"; } 2>/dev/null || true
      if [ "$(head -c 4 "$out.tmp" | od -An -tx1 | tr -d ' \n')" = 7f454c46 ]; then
        mv -f "$out.tmp" "$out"; return 0
      fi
    done
  done
  rm -f "$out.tmp"; return 1
}

# -------------------------------------------------------------- initramfs
# Modules, in load order (dependencies resolved by modprobe --show-depends).
MODS="virtio_pci virtio_mmio 9pnet_virtio 9p dummy veth virtio_net
      crc32_generic rdma_rxe ib_uverbs rdma_ucm ib_umad"
# (crc32-pclmul is deliberately not loaded: rxe's ICRC is faster under TCG
#  with crc32_generic; there is no /sbin/modprobe in the initramfs, so
#  nothing is auto-loaded behind our back.)

read -r -d '' GUEST_INIT <<'INIT_EOF' || true
#!/bin/busybox sh
# PID 1 of the sluice rxe guest.
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
hostname sluice-rxe
fail() { echo "sluice-rxe-init: FATAL: $*" > /dev/ttyS0; echo "sluice-rxe-init: FATAL: $*" > /dev/ttyS2; echo 125 > /ctl/rc 2>/dev/null; sync; reboot -f; }
t() { echo "sluice-rxe-init: $(cut -d' ' -f1 /proc/uptime)s $*" > /dev/kmsg; }
t start
while read -r m a; do insmod /mods/$m $a 2>/dev/null || echo "sluice-rxe-init: insmod $m failed" > /dev/kmsg; done < /modules.list
t modules-loaded
O9P="trans=virtio,version=9p2000.L,msize=512000"
mkdir -p /ctl /host
mount -t 9p -o $O9P,cache=none rxectl /ctl || fail "cannot mount control share"
. /ctl/env
mount -t 9p -o $O9P,ro,cache=loose hostroot /host || fail "cannot mount host root"
for d in proc sys dev; do mount --bind /$d /host/$d; done
mkdir -p /host/dev/pts /host/dev/shm
mount -t devpts -o newinstance,ptmxmode=0666 devpts /host/dev/pts
mount -t tmpfs shm /host/dev/shm
for d in /tmp /run /var/tmp /root; do mount -t tmpfs -o mode=1777 tmpfs /host$d || fail "tmpfs $d"; done
chmod 700 /host/root
mkdir -p /host/run/rxe-ctl && mount --bind /ctl /host/run/rxe-ctl
i=0
while read -r p; do
  [ -n "$p" ] || continue
  mkdir -p "/host$p" 2>/dev/null
  mount -t 9p -o $O9P,cache=mmap share$i "/host$p" || fail "cannot mount share $p"
  i=$((i+1))
done < /ctl/shares
t mounted
# network + rxe (iproute2/rdma tools come from the host root)
hip() { chroot /host /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin "$@"; }
ip link set lo up
case $RXE_NETDEV in
  dummy)  hip ip link add dummy0 type dummy; ND=dummy0 ;;
  veth)   hip ip link add veth0 type veth peer name veth1; ip link set veth1 up; ND=veth0 ;;
  lo)     ND=lo ;;
  virtio) ND=$(ls /sys/class/net | grep -v -e '^lo$' -e dummy | head -n1) ;;
esac
[ -n "$ND" ] || fail "no netdev for $RXE_NETDEV"
IP=${RXE_IP_ADDR:-10.0.0.1}; [ "$ND" = lo ] && IP=127.0.0.1
[ "$ND" = lo ] || ip addr add $IP/24 dev $ND
[ -n "$RXE_MTU" ] && ip link set $ND mtu $RXE_MTU
ip link set $ND up
hip rdma link add rxe0 type rxe netdev $ND || fail "rdma link add rxe0 failed"
# extra devices (--rxe-devices N): rxe<k> on dummy<k>, 10.0.<k>.1/24
DEVS=rxe0; NDS=$ND; IPS=$IP
k=1
while [ $k -lt ${RXE_DEVICES:-1} ]; do
  hip ip link add dummy$k type dummy || fail "ip link add dummy$k failed"
  ip addr add 10.0.$k.1/24 dev dummy$k
  [ -n "$RXE_MTU" ] && ip link set dummy$k mtu $RXE_MTU
  ip link set dummy$k up
  hip rdma link add rxe$k type rxe netdev dummy$k || fail "rdma link add rxe$k failed"
  DEVS="$DEVS rxe$k"; NDS="$NDS dummy$k"; IPS="$IPS 10.0.$k.1"
  k=$((k+1))
done
# wait for each port to be ACTIVE and its IPv4 (RoCE v2) GID to show up
gid_index() {  # dev -> index of its ::ffff:a.b.c.d RoCE v2 GID (empty if none yet)
  local g v ty
  for g in 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15; do   # (the table has 1024 entries)
    v=; read -r v < /sys/class/infiniband/$1/ports/1/gids/$g 2>/dev/null
    case $v in 0000:0000:0000:0000:0000:ffff:*)
      ty=; read -r ty < /sys/class/infiniband/$1/ports/1/gid_attrs/types/$g 2>/dev/null
      case $ty in *[Vv]1*) continue;; esac
      echo $g; return;;
    esac
  done
}
GIDXS=
for d in $DEVS; do
  x=
  n=0
  while [ $n -lt 100 ]; do
    if grep -q ACTIVE /sys/class/infiniband/$d/ports/1/state 2>/dev/null; then
      x=$(gid_index $d)
      [ -n "$x" ] && break
      [ "$ND" = lo ] && [ $d = rxe0 ] && break
    fi
    n=$((n+1)); usleep 50000
  done
  [ -n "$x" ] || x=0
  GIDXS="${GIDXS:+$GIDXS }$x"
done
GIDX=${GIDXS%% *}
t rxe-up
# run the command: stdout -> ttyS1, stderr -> ttyS2 (both raw)
stty -F /dev/ttyS1 raw -echo 2>/dev/null
stty -F /dev/ttyS2 raw -echo 2>/dev/null
ulimit -l unlimited
ulimit -n 65536 2>/dev/null
cd /host
env -i HOME=/root TERM=dumb USER=root LOGNAME=root \
  PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  RXE_DEV=rxe0 RXE_NETDEV=$ND RXE_IP=$IP RXE_GID_INDEX=$GIDX RXE_GUEST=1 \
  RXE_DEVS="$DEVS" RXE_NETDEVS="$NDS" RXE_IPS="$IPS" RXE_GID_INDEXES="$GIDXS" \
  chroot /host /bin/bash /run/rxe-ctl/cmd.sh < /dev/null > /dev/ttyS1 2> /dev/ttyS2
echo $? > /ctl/rc
t command-done
sync
umount -a -r 2>/dev/null
reboot -f
INIT_EOF

BUSYBOX=/bin/busybox
modfiles=$(for m in $MODS; do modprobe -S "$KVER" --show-depends "$m" 2>/dev/null | awk '$1=="insmod"{print $2}'; done | awk '!seen[$0]++')
[ -n "$modfiles" ] || die "cannot resolve modules for $KVER"
key=$( { echo "$KVER"; printf '%s\n' "$GUEST_INIT"; echo "$modfiles"; sha256sum "$BUSYBOX" $modfiles; } | sha256sum | cut -c1-16)
INITRD=$CACHE/initrd-$KVER-$key.cpio.gz
if [ $REBUILD = 1 ] || [ ! -s "$INITRD" ]; then
  mkdir -p "$CACHE" || die "cannot create cache dir $CACHE (set RXE_CACHE)"
  b=$(mktemp -d "$CACHE/build.XXXXXX")
  mkdir -p "$b/root/bin" "$b/root/mods" "$b/root/proc" "$b/root/sys" "$b/root/dev"
  cp "$BUSYBOX" "$b/root/bin/busybox"
  printf '%s\n' "$GUEST_INIT" > "$b/root/init"; chmod 755 "$b/root/init"
  : > "$b/root/modules.list"
  for f in $modfiles; do
    n=${f##*/}
    case $n in
      *.ko.xz)  xz -dc "$f" > "$b/root/mods/${n%.xz}";  n=${n%.xz};;
      *.ko.zst) zstd -qdc "$f" > "$b/root/mods/${n%.zst}"; n=${n%.zst};;
      *.ko.gz)  gzip -dc "$f" > "$b/root/mods/${n%.gz}"; n=${n%.gz};;
      *)        cp "$f" "$b/root/mods/";;
    esac
    case $n in dummy.ko) echo "$n numdummies=0";; *) echo "$n";; esac >> "$b/root/modules.list"
  done
  (cd "$b/root" && find . | LC_ALL=C sort | cpio -o -H newc -R 0:0 --quiet | gzip -1 > "$b/initrd.gz") \
    || die "building initramfs failed"
  mv -f "$b/initrd.gz" "$INITRD"
  rm -rf "$b"
  for f in "$CACHE"/initrd-*.cpio.gz; do [ "$f" = "$INITRD" ] || rm -f "$f"; done
  warn "built $INITRD"
fi

KERNEL=${RXE_KERNEL:-}
if [ -z "$KERNEL" ]; then
  KERNEL=$BZIMAGE
  if grep -qx 'CONFIG_PVH=y' "/boot/config-$KVER" 2>/dev/null; then
    VMLINUX=$CACHE/vmlinux-$KVER-$(sha256sum "$BZIMAGE" | cut -c1-12)
    if [ ! -s "$VMLINUX" ] || [ $REBUILD = 1 ]; then
      mkdir -p "$CACHE"; rm -f "$CACHE"/vmlinux-*
      extract_vmlinux "$BZIMAGE" "$VMLINUX" || warn "could not extract vmlinux from $BZIMAGE; booting the bzImage (slower)"
    fi
    [ -s "$VMLINUX" ] && KERNEL=$VMLINUX
  fi
fi
[ $BUILD_ONLY = 1 ] && { echo "kernel: $KERNEL"; echo "initrd: $INITRD"; exit 0; }

# -------------------------------------------------------------- accelerator
# TCG CPU model: "max" minus ERMS/FSRM.  With ERMS the guest kernel copies
# with "rep movsb", which TCG emulates very slowly (boot and rxe payload
# copies get ~2x slower).  All other ISA extensions of "max" (AVX2, PCLMUL,
# SSE4.2, ...) stay, so host binaries built for newer CPUs still run.
TCG_CPU=${RXE_TCG_CPU:-max,-erms,-fsrm}
kvm_ok=0; kvm_why=
if [ ! -e /dev/kvm ]; then kvm_why="/dev/kvm does not exist"
elif [ ! -r /dev/kvm ] || [ ! -w /dev/kvm ]; then kvm_why="/dev/kvm is not read/writable by $(id -un)"
elif ! grep -qw -e vmx -e svm /proc/cpuinfo; then
  kvm_why="the CPU exposes no VT-x/AMD-V (vmx/svm) flag"
  [ -d /sys/module/kvm_pvm ] && kvm_why="$kvm_why; /dev/kvm is kvm_pvm (PVM), which cannot run a stock kernel at usable speed"
else kvm_ok=1; fi
case $ACCEL in
  kvm)  [ $kvm_ok = 1 ] || die "KVM unavailable: $kvm_why"; ACC=(-accel kvm -cpu host);;
  tcg)  ACC=(-accel tcg,thread=multi,tb-size=128 -cpu "$TCG_CPU");;
  auto) if [ $kvm_ok = 1 ]; then ACC=(-accel kvm -cpu host)
        else warn "KVM unavailable ($kvm_why); using TCG software emulation (slower)"
             ACC=(-accel tcg,thread=multi,tb-size=128 -cpu "$TCG_CPU"); fi;;
esac

# -------------------------------------------------------------- run
RUN=$(mktemp -d "${TMPDIR:-/tmp}/sluice-rxe.XXXXXX")
QPID=
cleanup() { [ -n "$QPID" ] && kill "$QPID" 2>/dev/null; rm -rf "$RUN"; return 0; }
trap cleanup EXIT
trap 'exit 130' INT TERM
{
  for e in "${ENVS[@]}"; do printf 'export %q=%q\n' "${e%%=*}" "${e#*=}"; done
  printf 'cd %q || exit 125\n' "$CHDIR"
  printf 'exec'; printf ' %q' "$@"; printf '\n'
} > "$RUN/cmd.sh"
printf '%s\n' "${SHARES[@]}" > "$RUN/shares"
printf 'RXE_NETDEV=%s\nRXE_MTU=%s\nRXE_IP_ADDR=%s\nRXE_DEVICES=%s\n' "$NETDEV" "$MTU" "$IPADDR" "$NDEVS" > "$RUN/env"

VIRTFS=(-virtfs "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap"
        -virtfs "local,path=$RUN,mount_tag=rxectl,security_model=none")
i=0
for s in "${SHARES[@]}"; do
  VIRTFS+=(-virtfs "local,path=$s,mount_tag=share$i,security_model=none,multidevs=remap"); i=$((i+1))
done
NET=()
if [ "$NETDEV" = virtio ]; then
  if [ -n "$SOCKNET" ]; then
    mac=$(printf '52:54:00:00:00:%02x' "${IPADDR##*.}")
    NET=(-netdev "socket,id=n0,${SOCKNET%%:*}=127.0.0.1:${SOCKNET#*:}" -device "virtio-net-pci,netdev=n0,mac=$mac")
  elif [ -n "${RXE_QEMU_NET:-}" ]; then read -r -a NET <<<"$RXE_QEMU_NET"
  else NET=(-netdev user,id=n0,restrict=on -device virtio-net-pci,netdev=n0); fi
fi

QUIET=quiet; [ $VERBOSE = 1 ] && QUIET=
# stdout/stderr of the command come out of guest serial ports 1 and 2.
: > "$RUN/stdout"; : > "$RUN/stderr"

set +e
timeout -k 5 "$TIMEOUT" qemu-system-x86_64 \
  -machine pc "${ACC[@]}" -smp "$CPUS" -m "$MEM" \
  -nodefaults -no-user-config -display none -no-reboot \
  -kernel "$KERNEL" -initrd "$INITRD" \
  -append "console=ttyS0 $QUIET panic=-1 mitigations=off tsc=reliable no_timer_check i8042.noaux i8042.nokbd i8042.nopnp 8250.nr_uarts=3 random.trust_cpu=on" \
  -serial "file:$RUN/console.log" \
  -chardev "file,id=cout,path=$RUN/stdout" -serial chardev:cout \
  -chardev "file,id=cerr,path=$RUN/stderr" -serial chardev:cerr \
  "${VIRTFS[@]}" "${NET[@]}" < /dev/null > "$RUN/qemu.log" 2>&1 &
QPID=$!
tail -s 0.2 -n +1 -f --pid=$QPID "$RUN/stdout" &
T1=$!
tail -s 0.2 -n +1 -f --pid=$QPID "$RUN/stderr" >&2 &
T2=$!
wait $QPID; qrc=$?
QPID=
wait $T1 $T2 2>/dev/null
set -e

if [ $VERBOSE = 1 ]; then
  echo "----- guest console -----" >&2; cat "$RUN/console.log" >&2
fi
if [ $qrc = 124 ] || [ $qrc = 137 ]; then
  echo "$PROG: timeout after ${TIMEOUT}s; last guest console lines:" >&2; tail -n 20 "$RUN/console.log" >&2; exit 124
fi
if [ ! -s "$RUN/rc" ]; then
  echo "$PROG: guest failed (qemu exit $qrc) without reporting an exit status" >&2
  cat "$RUN/qemu.log" >&2; tail -n 40 "$RUN/console.log" >&2
  exit 125
fi
rc=$(cat "$RUN/rc")
exit "$rc"
