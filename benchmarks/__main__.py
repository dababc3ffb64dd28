from benchmarks.demo import main

main()
