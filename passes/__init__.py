"""glmc passes, one module each. A new pass adds a module and one line in `glmc.pipeline`."""
