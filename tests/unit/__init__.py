"""Pure checks of one module at a time: codecs, tables, plans, configuration; no sockets."""
