"""Discrete-event simulator of the RL pipeline at cluster scale: sync vs async throughput,
utilisation and staleness. See ``docs/simulator.md``."""

from saorl.sim.model import SimResult, compare, simulate
from saorl.sim.params import (
           DecodeCurve,
           LengthDist,
           SimInputError,
           SimParams,
           load_decode_curve,
           load_lengths,
)

__all__ = ["DecodeCurve", "LengthDist", "SimInputError", "SimParams", "SimResult", "compare",
           "load_decode_curve", "load_lengths", "simulate"]
