"""Tasks, trajectories, batching and task datasets."""

from saorl.data.task import Task
from saorl.data.trajectory import Trajectory, TrajectoryError

__all__ = ["Task", "Trajectory", "TrajectoryError"]
