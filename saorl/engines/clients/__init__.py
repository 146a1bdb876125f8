"""The clients of inference servers: ``saorl serve`` (HttpEngine), vLLM and SGLang, over one pooled
async transport; the wire formats of MoE routes and the LoRA adapters loaded on servers."""
