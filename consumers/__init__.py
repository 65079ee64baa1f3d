"""Consumers of generation events: trajectory assembly, rewards, verl batches.

* :mod:`consumers.trajectory`: the :class:`Trajectory` model (token-exact chains of turns);
* :mod:`consumers.trajectories`: building trajectories from one session's events (pure);
* :mod:`consumers.assembler`: the durable consumer that emits trajectories exactly once;
* :mod:`consumers.rewards`: programmatic rewards (``--reward-function``), run by the assembler;
* :mod:`consumers.reward_worker`: the reward worker (``stream-gateway reward``): scorers
  (:mod:`consumers.scorers`, :mod:`consumers.judge`) run once per trajectory each, on replicas;
* :mod:`consumers.scores`: their records, and the batcher's reward formula over them;
* :mod:`consumers.signals`: each turn's implicit signals (retried, edited, a failed tool call,
  abandoned, accepted), folded from its session's events, and the ``signals`` scorer's weights;
* :mod:`consumers.batcher`: groups trajectories into training batches (parquet + manifest);
* :mod:`consumers.grouping`: the batcher's policies and grouping, without I/O (:class:`GroupPlanner`);
* :mod:`consumers.batch_record`: the batcher's durable record of a batch, and why it makes exactly once;
* :mod:`consumers.images`: a trajectory's images, rebuilt from the image bucket and checked against
  the pixel digests recorded while sampling (the batcher and the trainer run it);
* :mod:`consumers.verl_batch`: verl's padded ``DataProto`` and jagged ``TensorDict`` layouts;
* :mod:`consumers.verl_vision`: their vision part (``multi_modal_inputs``, multimodal rotary positions);
* :mod:`consumers.verl_adapter`: a verl 0.9 agent loop manager that trains on the stream;
* :mod:`consumers.verl_weights`: a verl 0.9 checkpoint manager that publishes each step's weights;
* :mod:`consumers.streams`, :mod:`consumers.parquet`: names, provisioning, the batch artifact.

Never imports :mod:`stream_gateway`. torch, verl and pyarrow are imported by the modules that
need them, so importing this package stays cheap: :class:`StreamCheckpointManager` is exported
lazily (its module imports verl, as verl's plugin registry requires).
"""

import typing

from .assembler import Assembler, AssemblerConfig, AssemblerStatistics, run_assembler
from .batch_record import BatchRecord
from .batcher import Batcher, BatcherConfig, BatcherStatistics, run_batcher
from .errors import ConsumerError, ImagesRefused
from .grouping import GroupingPolicy, GroupPlanner
from .reward_worker import RewardWorker, RewardWorkerConfig, RewardWorkerStatistics, run_reward_worker
from .scores import RewardFormula, ScoreRecord
from .streams import ConsumerStreams
from .trajectories import SessionEvents, build_trajectories
from .trajectory import Trajectory, TurnSummary, trajectory_id

if typing.TYPE_CHECKING:
    from .verl_weights import StreamCheckpointManager

__all__ = [
    "Assembler",
    "AssemblerConfig",
    "AssemblerStatistics",
    "BatchRecord",
    "Batcher",
    "BatcherConfig",
    "BatcherStatistics",
    "ConsumerError",
    "ConsumerStreams",
    "GroupPlanner",
    "GroupingPolicy",
    "ImagesRefused",
    "RewardFormula",
    "RewardWorker",
    "RewardWorkerConfig",
    "RewardWorkerStatistics",
    "ScoreRecord",
    "SessionEvents",
    "StreamCheckpointManager",
    "Trajectory",
    "TurnSummary",
    "build_trajectories",
    "run_assembler",
    "run_batcher",
    "run_reward_worker",
    "trajectory_id",
]


def __getattr__(name: str) -> typing.Any:
    """Import :mod:`consumers.verl_weights` (verl, ray: seconds) on first use of its export only."""
    if name == "StreamCheckpointManager":
        from .verl_weights import StreamCheckpointManager

        return StreamCheckpointManager
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
