"""The corrections' one log line each."""

import logging

logger = logging.getLogger("tpp_fairseq")
_logged = set()


def log_once(key: str, message: str, *args) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.info(message, *args)
