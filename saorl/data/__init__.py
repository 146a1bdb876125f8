"""Trajectories, batching and task datasets."""

from saorl.data.trajectory import Trajectory, TrajectoryError

__all__ = ["Trajectory", "TrajectoryError"]
