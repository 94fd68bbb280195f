"""Drop-in front ends that let code written for other training libraries run on distkit.

* :mod:`distkit.compat.perceptrain`: perceptrain's ``TrainConfig`` / ``Trainer`` /
  ``optimize_step`` on distkit's Session (every engine, grad and param mode).

Each front end is built only on the public ``distkit.init()`` / :class:`~distkit.session.Session`
API (plus distkit's own spawner), like ``examples/byo_loop.py``.
"""
