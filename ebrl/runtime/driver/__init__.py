"""The driver: one loop (:mod:`~ebrl.runtime.driver.loop`) turns blocks of finished steps into records and
new requests, answered by the episodes' bookkeeping and seeds (:mod:`~ebrl.runtime.driver.episodes`) and by
fault recovery and env moves (:mod:`~ebrl.runtime.driver.recovery`)."""

from ebrl.runtime.driver.loop import Driver

__all__ = ["Driver"]
