"""``trainvitals audit``: the health of a finished (or running) job read from the
checkpoints it leaves behind, offline (docs/audit.md). Needs torch and, for
safetensors files, the ``safetensors`` package (the ``audit`` extra)."""
