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
version changed since their last update. See docs/weights.md.
"""

from ._meta import Snapshot, TensorInfo
from .errors import TensorMismatchError, TrainerLostError, WeightsChangedError, WeightsError
from .publisher import WeightPublisher
from .subscriber import UpdateResult, WeightSubscriber

__all__ = [
    "WeightPublisher", "WeightSubscriber", "UpdateResult", "Snapshot", "TensorInfo",
    "WeightsError", "TrainerLostError", "TensorMismatchError", "WeightsChangedError",
]
