"""Distillation's offline jobs, apart from its runtime (`lmforge.distill`): the
teachers' top-k cache (`lmforge distill cache`), their answers to prompts as an
instruction dataset (`lmforge distill generate`), and pipelines of stages
(`lmforge distill run`)."""
