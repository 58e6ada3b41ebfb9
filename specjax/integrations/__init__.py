"""Optional integrations with other JAX libraries; none is imported by `import specjax`.

* `specjax.integrations.tunix`: `SpecjaxRollout`, a rollout engine for tunix's RL trainers
  (`pip install 'specjax[tunix]'`); `specjax.integrations.tunix_weights` converts tunix's nnx
  policies (Qwen2, Qwen3, Llama 3) to `specjax.Model`s in pure jnp, inside a jitted step.
"""
