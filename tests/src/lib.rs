//! Integration tests live in `tests/`; see `tests/support` for fixtures.
