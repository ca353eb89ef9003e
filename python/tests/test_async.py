"""asyncio: completions wake the event loop (Future.on_complete -> call_soon_threadsafe)."""
import asyncio
import threading

import numpy as np
import pytest

import sluice
from conftest import pattern


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_gather_reads(pair):
    src = pattern(1 << 20)
    pair.b.register(src, name="s")
    dst = np.zeros_like(src)
    hd = pair.a.register(dst)
    r = pair.ep.remote_region("s")

    async def main():
        threads_before = threading.active_count()
        fs = await asyncio.gather(*[pair.ep.read_async([(hd, o, r, o, 16384)]) for o in range(0, src.nbytes, 16384)])
        assert threading.active_count() == threads_before  # no thread per operation
        return fs

    fs = run(main())
    assert len(fs) == 64 and all(f.bytes == 16384 for f in fs)
    assert np.array_equal(src, dst)


def test_all_async_ops(pair):
    src = pattern(4096, 1)
    hs = pair.a.register(src)
    dst = np.zeros(4096, np.uint8)
    hd = pair.b.register(dst, name="d")

    async def main():
        r = pair.ep.remote_region("d")
        imm = asyncio.ensure_future(pair.peer.imm_recv_async())
        await pair.ep.write_async([(hs, 0, r, 0, 2048)])
        await pair.ep.write_with_imm_async([(hs, 2048, r, 2048, 2048)], 77)
        assert (await imm).imm == 77
        back = np.zeros(4096, np.uint8)
        hb = pair.a.register(back)
        await pair.ep.read_async([(hb, 0, r, 0, 4096)])
        assert np.array_equal(back, src)
        rv = asyncio.ensure_future(pair.peer.recv_async(hd, 0, 100))
        s = await pair.ep.send_async(hs, 0, 50)
        assert s.bytes in (0, 50)
        assert (await rv).bytes == 50
        f = await pair.ep.read([(hb, 0, r, 0, 8)])  # a Future is awaitable
        assert f.done()

    run(main())


def test_async_errors(pair):
    # Larger than shm.eager_max: the send waits for the receiver and fails with it.
    hs = pair.a.register(np.zeros((64 << 10) + 1, np.uint8))
    hr = pair.b.register(np.zeros(10, np.uint8))

    async def main():
        with pytest.raises(sluice.EmptyBatchError):  # caller errors raise at submission
            await pair.ep.read_async([])
        rv = asyncio.ensure_future(pair.peer.recv_async(hr))
        with pytest.raises(sluice.TruncatedError):  # completion errors raise from await
            await pair.ep.send_async(hs)
        with pytest.raises(sluice.TruncatedError):
            await rv

    run(main())


def test_await_then_engine_closed(pair):
    h = pair.a.register(np.zeros(64, np.uint8))

    async def main():
        waiting = asyncio.ensure_future(pair.ep.recv_async(h))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        await asyncio.get_running_loop().run_in_executor(None, pair.a.close)
        with pytest.raises(sluice.CancelledError):
            await waiting

    run(main())


def test_task_cancel_leaves_engine_usable(pair):
    h = pair.a.register(np.zeros(64, np.uint8))
    hb = pair.b.register(np.ones(64, np.uint8))

    async def main():
        t = asyncio.ensure_future(pair.ep.recv_async(h))
        await asyncio.sleep(0.02)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        # the recv is still posted in the engine: the next send completes it
        await pair.peer.send_async(hb)

    run(main())


def test_completion_after_loop_closed(pair):
    """A completion that arrives after its event loop closed is dropped quietly."""
    h = pair.a.register(np.zeros(64, np.uint8))
    loop = asyncio.new_event_loop()
    fut = pair.ep.recv(h)

    async def start():
        task = asyncio.ensure_future(_aw(fut))
        await asyncio.sleep(0.01)
        task.cancel()

    async def _aw(f):
        return await f

    loop.run_until_complete(start())
    loop.close()
    pair.peer.send(pair.b.register(np.ones(4, np.uint8))).result(10)
    fut.result(10)
