"""How each policy version reaches the rollout engines: versioned files, servers updated in
place (vLLM / SGLang) and checked, and Ray's object store."""
