"""Write docs/openapi.json from the app (a test checks the committed file is current)."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    from exporter.api import create_app
    from exporter.service import Services
    from exporter.settings import Settings

    with tempfile.TemporaryDirectory() as d:
        services = Services(Settings(data_dir=Path(d)))
        spec = create_app(services).openapi()
        services.close()
    (ROOT / "docs" / "openapi.json").write_text(json.dumps(spec, indent=2, sort_keys=True) + "\n")
    print(f"wrote docs/openapi.json ({len(spec['paths'])} paths)")


if __name__ == "__main__":
    main()
