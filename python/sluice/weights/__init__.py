"""sluice.weights: push fresh weights from a trainer to inference processes.

Trainer::

    pub = WeightPublisher(engine, "policy")
    pub.register(model.state_dict())          # once: each tensor becomes a region
    for step in ...:
        with pub.updating(step):              # receivers never keep half-written tensors
            optimizer.step()

Inference::

    sub = WeightSubscriber(engine, trainer_ref)       # "host:port", info blob or directory name
    sub.update(dict(model.named_parameters()), on_bucket=model.load_weights)

Receivers READ the trainer's tensors one-sided, in buckets, and only the tensors whose
version changed since their last update. A receiver may relay (``relay=True``) and others pull
from it (``source=``), so the trainer sends each byte once per tree of receivers
(``relay_parent`` lays one out, ``relay_layout`` one by host); the processes of one host can
share the host-to-device work (``StripedSubscriber``), with pullers chosen by NIC and GPU
affinity (``probe_placement``, ``plan_pulls``). Or the trainer pushes (``pub.push()`` into
``WeightSink.receive()``: a write-with-immediate per bucket), and an inference process that
cannot run an engine takes them from a staging buffer shared through CUDA IPC
(``sluice.weights.staging``). See docs/weights.md.
"""

from ._meta import Snapshot, TensorInfo
from ._relay import host_layout as relay_layout
from ._relay import tree_parent as relay_parent
from .errors import TensorMismatchError, TrainerLostError, WeightsChangedError, WeightsError
from .placement import Placement, PullPlan, plan_pulls
from .placement import probe as probe_placement
from .publisher import WeightPublisher
from .push import PushResult, SinkReport, WeightSink
from .staging import StagingClient, StagingServer, receive_from_staging
from .striped import StripedSubscriber
from .subscriber import UpdateResult, WeightSubscriber

__all__ = [
    "WeightPublisher", "WeightSubscriber", "StripedSubscriber", "WeightSink", "PushResult", "SinkReport", "UpdateResult", "Snapshot", "TensorInfo", "relay_parent", "relay_layout",
    "Placement", "PullPlan", "plan_pulls", "probe_placement", "StagingServer", "StagingClient", "receive_from_staging",
    "WeightsError", "TrainerLostError", "TensorMismatchError", "WeightsChangedError",
]
