"""Graph edits that more than one pass makes, or that a pass's driver hands off: each builds or
rewires nodes of a graph the analyses have already read (`graphpass.analysis` reads, never edits)."""
