"""Every training script's declaration of what its mode is (its ``MODE``, a :class:`common.run.Mode`),
for the tools that read them rather than keep copies (``common.evaluate``)."""

from __future__ import annotations

from common.run import Mode


def declared_modes() -> tuple[Mode, ...]:
    """The modes of the four training scripts. Importing a script loads no torch (its ``--help`` answers
    before torch has loaded), so this costs a fraction of a second."""
    import parallel_train_dqn
    import train_parallel_timed
    import train_ppo_multiprocess
    import ultra_parallel_train_dqn

    return tuple(script.MODE for script in (ultra_parallel_train_dqn, train_ppo_multiprocess, parallel_train_dqn,
                                            train_parallel_timed))
