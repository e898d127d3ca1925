"""`deepspeed.runtime`: the module paths scripts and libraries import from (see
docs/migrating-from-deepspeed.md)."""
