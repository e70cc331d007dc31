"""Instruction distillation: teachers answer prompts on Ray Data, the good answers are
kept, and the student is fine-tuned on them (with the teachers' top-k soft targets)."""
