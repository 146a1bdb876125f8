"""saorl's worker extension for vLLM 0.32 servers: an in-place weight reload that is exact on the
CPU build for Mixture-of-Experts models too.

This file is loaded by the *vLLM* server, not by saorl: it imports only torch and vllm, and its
directory is put on the server's ``PYTHONPATH``::

    PYTHONPATH="$(saorl check-server --plugin-dir)" VLLM_SERVER_DEV_MODE=1 \\
        python -m vllm.entrypoints.openai.api_server ... --worker-extension-cls saorl_vllm.WeightReload

Why. vLLM's ``reload_weights`` (``vllm/model_executor/model_loader/reload/layerwise.py``) loads a
layer's new checkpoint tensors and re-runs the layer's quantization method's
``process_weights_after_loading``; for unquantized experts that method skips the experts' own
post-processing on every load but the first (``_setup_kernel`` in
``fused_moe/unquantized_fused_moe_method.py``: ``is_weight_update``). On the CPU build that
skipped step is the prepack of ``w13_weight`` / ``w2_weight`` into the grouped-GEMM layout
(``fused_moe/experts/cpu_moe.py``), so after a reload the fused-MoE kernel reads plain weights as
if they were packed: measured 0.13 nats per token off (max 2.98) after reloading the *identical*
checkpoint of a tiny Qwen3-MoE. :meth:`WeightReload.saorl_reload_weights` runs vLLM's reload, then
packs each such layer's experts again, in place (the storage the kernel holds). On a GPU build no
layer uses the CPU experts and the method is exactly ``reload_weights``.
"""

from __future__ import annotations

import torch


class WeightReload:
    """Methods mixed into vLLM's worker (``--worker-extension-cls saorl_vllm.WeightReload``),
    called through ``POST /collective_rpc``."""

    def saorl_reload_weights(self, weights_path: str) -> int:
        """The worker's own ``reload_weights`` from the Hugging Face directory ``weights_path``,
        then the CPU experts packed again; returns how many MoE layers were packed.
        Pinned to vLLM 0.32 (the layout it packs); saorl calls it on CPU servers only."""
        import vllm

        if not vllm.__version__.startswith("0.32."):
            raise RuntimeError(f"saorl's vLLM plugin is written for vLLM 0.32, this is {vllm.__version__}")
        self.reload_weights(weights_path=weights_path)
        # saorl calls this on CPU servers only: without these the experts would stay scrambled, so
        # an ImportError here must fail the publication, never pass as "nothing to pack"
        from vllm._custom_ops import cpu_prepack_moe_weight
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

        packed = 0
        for layer in self.model_runner.get_model().modules():
            kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch", False):
                continue
            with torch.no_grad():
                for name in ("w13_weight", "w2_weight"):
                    weight = getattr(layer, name)
                    weight.data.copy_(cpu_prepack_moe_weight(weight.data.clone(), experts.isa))
            packed += 1
        return packed
