"""Evaluating models beyond the held-out loss training logs: `lmforge eval judge`
(`judge.py`), a judge model comparing two models' answers, pair by pair."""
