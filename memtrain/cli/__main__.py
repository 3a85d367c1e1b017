import sys

from memtrain.cli import main

sys.exit(main())
