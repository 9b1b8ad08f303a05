"""What every screen shares: the help screen, the status line, the palette, live text and table rows."""
