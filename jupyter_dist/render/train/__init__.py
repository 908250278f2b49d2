"""The generated ``train.py``, piece by piece.

The entry point is :func:`jupyter_dist.render.torch_code.render_train_script`.

One module per concern, so a change to the generated code reads as a change to the part it touches:

* ``text``: filling templates, wrapping lines, sorting imports (the assembler's tools);
* ``model_tpl``, ``parallel_tpl``, ``pipeline_tpl``, ``context_tpl``, ``expert_tpl``, ``loop_tpl``: the generated code
  itself, as templates (the demo model, data and flags; DDP/FSDP/FSDP2/tensor parallelism and the device mesh;
  pipeline stages and schedules; context parallelism; expert parallelism; the optimizer, checkpoints and the
  training loop);
* ``base``, ``parallel``, ``script``: the assembler, which picks and fills the templates for one candidate and records
  the imports each section uses (the plan's numbers and the script's sections; the model-parallel sections; ``main``).
"""
