"""The server APIs ``saorl serve --emulate NAME`` imitates, one row each, and what each changes in
the routes ``saorl serve`` has anyway. The routes a row adds are in :mod:`saorl.engines.serve.emulation`;
a row exists so that the client of an engine kind updated in place (:mod:`saorl.config.engines`) can
be tested against ``saorl serve``, so every name here is such a kind (a test holds it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Emulation:
    name: str
    routes_always: bool
    """Every completion carries ``routed_experts`` when the model records routes (vLLM started with
    ``--enable-return-routed-experts``), not only the requests that ask."""
    own_version: bool
    """``/version`` answers as the emulated server does (the emulation's route), not saorl's."""
    logprobs_modes: tuple[str, ...] = ()
    """``--logprobs-mode`` values (vLLM's); empty: the API has no such option."""


EMULATIONS: dict[str, Emulation] = {
    "vllm": Emulation("vllm", routes_always=True, own_version=True,
                      logprobs_modes=("raw_logprobs", "processed_logprobs")),
    "sglang": Emulation("sglang", routes_always=False, own_version=False),
}


def emulation_of(name: str | None, what: str = "emulate") -> Emulation | None:
    """The row named ``name`` (None: no emulation); a ValueError naming ``what`` and the choices
    otherwise."""
    if name is None:
        return None
    if name not in EMULATIONS:
        raise ValueError(f"{what} must be one of {', '.join(EMULATIONS)}, got {name!r}")
    return EMULATIONS[name]
