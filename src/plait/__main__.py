from plait.cli import main

raise SystemExit(main())
