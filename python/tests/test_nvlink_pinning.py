"""nvlink page-locks a peer's mapped memfd region on its first GPU copy (nvlink.pin_host_mappings)
only when every page of it is in memory: a peer's sparse region must not make this process
commit memory the peer never touched. Two processes on one GPU; skips without a GPU (CI has
none; the device runs run it)."""

import multiprocessing as mp

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device visible to torch", allow_module_level=True)

import sluice  # noqa: E402

SPARSE = 256 << 20
TOUCHED = 64 << 20


def owner(conn):
    import ctypes

    with sluice.Engine() as e:
        # An engine allocation is populated by its owner; a hostile or careless owner can hand
        # out a sparse one. MADV_REMOVE punches every page out of the memfd: not in memory.
        sparse, _ = e.allocate(SPARSE, name="sparse")
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        if libc.madvise(sparse.ctypes.data, SPARSE, 9) != 0:  # 9: MADV_REMOVE
            raise OSError(ctypes.get_errno(), "madvise(MADV_REMOVE)")
        buf, _ = e.allocate(TOUCHED, name="touched")
        buf[:] = 7  # every page written
        conn.send(e.listen_address)
        conn.recv()


def test_only_a_resident_region_is_page_locked(capfd):
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    p = ctx.Process(target=owner, args=(child,), daemon=True)
    p.start()
    try:
        assert conn.poll(60), "the owner did not start"
        ref = conn.recv()
        with sluice.Engine(log_level="info") as e:
            ep = e.connect(ref)
            assert ep.transport == "nvlink"
            dst = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
            h = e.register(dst)
            for name in ("sparse", "touched"):
                ep.read([(h, 0, ep.remote_region(name), 0, 1 << 20)]).result()
            assert bool((dst == 7).all())  # the last read, from the touched region
        err = capfd.readouterr().err
        locked_not = [line for line in err.splitlines() if "is not page-locked" in line]
        assert any(f"region of {SPARSE} bytes" in line and "not in memory" in line for line in locked_not), err[-2000:]
        assert not any(f"region of {TOUCHED} bytes" in line for line in locked_not), err[-2000:]
    finally:
        conn.send("stop")
        p.join(30)


def gpu_owner(conn):
    """A peer with a GPU region: the target of our writes (a trainer pushing into it)."""
    with sluice.Engine() as e:
        dst = torch.zeros(TOUCHED, dtype=torch.uint8, device="cuda")
        e.register(dst, name="gpu")
        conn.send(e.listen_address)
        cmd = conn.recv()
        conn.send(int((dst == 7).sum()))  # after our writes: how many bytes hold them
        conn.recv()


def test_our_own_resident_region_is_page_locked_for_writes_to_a_gpu(capfd):
    """Writes out of our engine-allocated memory into a peer's GPU: a fully resident region is
    page-locked on its first copy (and unlocked when it goes), a sparse one is not."""
    import ctypes

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    p = ctx.Process(target=gpu_owner, args=(child,), daemon=True)
    p.start()
    try:
        assert conn.poll(60), "the owner did not start"
        ref = conn.recv()
        with sluice.Engine(log_level="info") as e:
            ep = e.connect(ref)
            assert ep.transport == "nvlink"
            sparse, hs = e.allocate(SPARSE)
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            assert libc.madvise(sparse.ctypes.data, SPARSE, 9) == 0  # MADV_REMOVE: no page in memory
            buf, ht = e.allocate(TOUCHED)
            buf[:] = 7
            gpu = ep.remote_region("gpu")
            ep.write([(hs, 0, gpu, 0, 1 << 20)]).result()
            ep.write([(ht, 0, gpu, 0, TOUCHED)]).result()
            conn.send("count")
            assert conn.poll(60)
            assert conn.recv() == TOUCHED  # every byte landed
            e.unregister(ht)  # unlocked before the engine unmaps it (nothing to see but no crash)
        err = capfd.readouterr().err
        assert any(f"page-locked our host region of {TOUCHED} bytes" in line for line in err.splitlines()), err[-2000:]
        assert any(f"our host region of {SPARSE} bytes is not page-locked" in line and "not in memory" in line
                   for line in err.splitlines()), err[-2000:]
    finally:
        conn.send("stop")
        p.join(30)
