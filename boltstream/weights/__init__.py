"""Weights shared by the learner and the inference workers: loading a model, and the checkpoint format.

Both sides must agree on these byte for byte (a checkpoint the learner writes is what a worker
loads), so they live in one place that neither side owns.
"""
