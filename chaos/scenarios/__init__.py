"""One module per scenario, each with ``async def run(work: Path, short: bool) -> Result``."""
