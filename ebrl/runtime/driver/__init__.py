"""The driver: one loop turns blocks of finished steps into records and new requests
(:mod:`ebrl.runtime.driver.loop`), with the episodes' statistics and seeds
(:mod:`~ebrl.runtime.driver.episodes`) and fault recovery and env moves
(:mod:`~ebrl.runtime.driver.recovery`) answering it."""

from ebrl.runtime.driver.loop import Driver

__all__ = ["Driver"]
