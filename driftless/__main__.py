from driftless.cli import main

raise SystemExit(main())
