"""Memory: the budget (how much GPU and host memory an engine may use), the plan that places each model under it
(`plan`), and the mechanisms that carry a plan out (`placement`: where each model lives and which phase holds what
on the device; `streaming`: layers streamed through a ring of device buffers; `homes`: pinned, memory-mapped and FP8
host copies)."""
