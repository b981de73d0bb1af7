"""The runtime: ``run`` assembles its parts on a ``platform`` and runs them under one TaskGroup
(docs/design.md names each part and walks one env step through them). Most users need only
:func:`ebrl.run`; virtual time is a platform of its own (:mod:`ebrl.virtual_time`)."""
