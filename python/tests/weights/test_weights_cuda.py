"""sluice.weights with CUDA tensors: a trainer process with CPU, shared-block or CUDA tensors,
receivers with CUDA (or CPU) targets; bytes checked against what the trainer wrote.
Skips without a GPU (CI has none; the device runs of python/tests/torch_backend/run_cuda.sh
run it)."""

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device visible to torch", allow_module_level=True)

import sluice  # noqa: E402
from sluice.weights import TensorMismatchError, WeightPublisher, WeightSubscriber  # noqa: E402

import weights_peer as wp  # noqa: E402
from test_weights_update import NAMES, SPEC, Trainer  # noqa: E402


def check(targets, version_of):
    bad = [n for n, d, s in SPEC
           if not torch.equal(wp.as_bytes(targets[n]).cpu(), wp.expected(n, d, s, version_of(n)))]
    assert not bad, f"wrong bytes in {bad[:5]}"


@pytest.mark.parametrize("mode", ["register", "share", "cuda"])
@pytest.mark.parametrize("transport", [None, "tcp"])
def test_cuda_targets_from_every_trainer_memory(mode, transport):
    t = Trainer(mode=mode)
    try:
        with sluice.Engine(transports=transport) as e:
            targets = wp.empty_targets(SPEC, "cuda")
            seen = []
            sub = WeightSubscriber(e, t.ref, bucket_bytes=128 << 10, timeout=60)
            res = sub.update(targets, on_bucket=lambda pairs: seen.extend(n for n, _ in pairs))
            assert sorted(res.updated) == NAMES and sorted(seen) == NAMES
            check(targets, t.versions.get)
            print(f"trainer {mode}, transport {e.connect(t.ref).transport}: {res.nbytes} B in {res.seconds:.3f} s")
            t.publish(2, ["l4.w", "l9.q"])
            assert sorted(sub.update(targets).updated) == ["l4.w", "l9.q"]
            check(targets, t.versions.get)
            # the same names into CPU targets: another target, so everything moves again
            cpu = wp.empty_targets(SPEC)
            assert sorted(sub.update(cpu).updated) == NAMES
            check(cpu, t.versions.get)
            sub.close()
    finally:
        t.stop()


def test_in_process_cuda_publisher_syncs_its_stream_at_publish():
    """The trainer's kernels on its current stream are done before receivers may read."""
    with sluice.Engine() as a, sluice.Engine() as b:
        w = torch.zeros(1 << 20, device="cuda")
        pub = WeightPublisher(a, "m")
        pub.register({"w": w})
        with pub.updating(1):
            torch.cuda._sleep(50_000_000)  # a long kernel first, then the write, on one stream
            w.fill_(3.0)
        got = torch.zeros(1 << 20, device="cuda")
        res = WeightSubscriber(b, a.listen_address, timeout=30).update({"w": got})
        assert res.version == 1 and bool((got == 3.0).all())
        with pytest.raises(TensorMismatchError, match="float32"):
            WeightSubscriber(b, a.listen_address, timeout=30).update({"w": torch.zeros(1 << 20, dtype=torch.float16,
                                                                                       device="cuda")})
        pub.close()
