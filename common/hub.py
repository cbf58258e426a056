"""Former name of :mod:`common.rank_exchange`, kept while importers move to it."""

from common.rank_exchange import (  # noqa: F401
    Field,
    Hub,
    Schema,
    Spoke,
    code_digest,
    follow_stop,
    interrupt_from_peer,
    stop_message,
)
