import sys

from trt_sora.cli import main

sys.exit(main())
