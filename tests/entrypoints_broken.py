"""A job module that fails when imported (the submit-time check must say so, in one line)."""

raise RuntimeError("this module is broken on purpose")
