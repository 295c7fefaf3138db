from vllm_overlay.main import main

raise SystemExit(main())
