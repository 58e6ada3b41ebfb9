"""The ground floor: sampling settings and warps, the KV cache, outputs, validation, token buffers.

Everything else in specjax builds on these; they import nothing of specjax outside `core`."""
