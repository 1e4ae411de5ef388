"""What a PNG file starts with: the load tests check the plots they draw against it."""

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
