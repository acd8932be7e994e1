// A job in which rank 1 stops taking part, to check that the others end with an error rather
// than hang. `dead_rank exit`: rank 1 exits early (status 0, as a crashed-but-clean process
// might). `dead_rank hang`: rank 1 stays alive but never joins the collective. `dead_rank recv`:
// in a group of world ranks 1 and 2, rank 1 waits for a message its peer never sends; the
// watchdog must name that peer as the logs do, world rank 2 (group rank 1).
// Run under mpirun by CTest through expect_failure.cmake, which bounds the time.

#include <chrono>
#include <cstring>
#include <iostream>
#include <thread>

#include "fivefold/dist.h"
#include "fivefold/log.h"
#include "fivefold/runtime.h"

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode != "exit" && mode != "hang" && mode != "recv") {
    std::cerr << "usage: dead_rank exit|hang|recv\n";
    return 2;
  }
  try {
    fivefold::Runtime runtime;
    auto world = runtime.world();
    auto x = torch::ones({1 << 18});
    world->all_reduce(x);  // everyone is alive here
    fivefold::log() << "alive, mode " << mode;
    if (mode == "recv") {
      auto pair = world->split(world->rank() == 0 ? 0 : 1, 0, "pair");  // world ranks 1, 2
      if (world->rank() == 1) {
        auto y = torch::zeros({1});
        pair->recv(y, 1);  // from world rank 2, which never sends
      }
      std::this_thread::sleep_for(std::chrono::minutes(5));
    }
    if (world->rank() == 1) {
      if (mode == "exit") std::_Exit(0);
      std::this_thread::sleep_for(std::chrono::minutes(5));
    }
    for (int i = 0; i < 3; ++i) world->all_reduce(x);
    fivefold::log() << "unexpectedly completed";
    return 0;
  } catch (const std::exception& e) {
    fivefold::log(fivefold::LogLevel::Error) << e.what();
    return 1;
  }
}
