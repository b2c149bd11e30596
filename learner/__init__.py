"""The learner (``boltstream learn``): GRPO/PPO on the ``batches`` topic, checkpoints to S3.

Submodules are imported on use; ``boltstream.learner.losses`` and ``.collate`` need only
torch. Start reading at :mod:`boltstream.learner.loop`.
"""
