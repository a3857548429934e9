from .serving.cli import main

raise SystemExit(main())
