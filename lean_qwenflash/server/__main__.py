import sys

from lean_qwenflash.server.main import main

sys.exit(main())
