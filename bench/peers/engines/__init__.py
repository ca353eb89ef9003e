"""One adapter module per engine. Each has `version() -> str`, `target(settings, cells)`
(prints READY <info>, serves until stdin closes) and `initiator(settings, cells, info) -> int`
(prints one RESULT line per cell, see common.emit). Two-sided cells are checked by the
receiving side, which prints CHECK lines."""
