from cvt.cli import main

main()
