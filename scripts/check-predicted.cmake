# Checks a run's measured.json: every communicator the trainer predicted (chapters 09-13's
# formulas) carried exactly the predicted bytes per step, on the mean over its ranks and on the
# busiest one (ep: on the mean; what one rank receives follows the routing), every rank's
# model state its ZeRO formula, and every rank's matmul FLOPs (ep: their sum) the formulas of
# predicted_flops. Prints what it checked; fails naming the first that differs.
#   cmake -DMEASURED=runs/x/measured.json -P scripts/check-predicted.cmake
if(NOT EXISTS "${MEASURED}")
  message(FATAL_ERROR "check-predicted: no ${MEASURED}")
endif()
file(READ "${MEASURED}" measured)
string(JSON groups LENGTH "${measured}" per_step_bytes)
set(checked "")
if(groups GREATER 0)
  math(EXPR last "${groups} - 1")
  foreach(i RANGE ${last})
    string(JSON group MEMBER "${measured}" per_step_bytes ${i})
    string(JSON predicted ERROR_VARIABLE none GET "${measured}" per_step_bytes ${group}
           predicted_mean)
    if(none)
      continue()  # no formula for this communicator
    endif()
    # The statistics the prediction is exact for (ep: the mean only; its ranks' shares follow
    # the routing).
    string(JSON exact_count LENGTH "${measured}" per_step_bytes ${group} exact)
    set(stats "")
    math(EXPR exact_last "${exact_count} - 1")
    foreach(k RANGE ${exact_last})
      string(JSON stat GET "${measured}" per_step_bytes ${group} exact ${k})
      list(APPEND stats ${stat})
    endforeach()
    foreach(stat ${stats})
      string(JSON got GET "${measured}" per_step_bytes ${group} ${stat})
      string(JSON want GET "${measured}" per_step_bytes ${group} predicted_${stat})
      if(NOT got EQUAL want)
        message(FATAL_ERROR "check-predicted: ${group} carried ${got} bytes a step (${stat} over "
                            "its ranks), predicted ${want} (${MEASURED})")
      endif()
    endforeach()
    list(APPEND checked ${group})
  endforeach()
endif()
# What each rank kept between steps (parameters, gradients, AdamW moments) against chapter 09's
# ZeRO formulas on its part, rank by rank.
string(JSON ranks ERROR_VARIABLE no_state LENGTH "${measured}" predicted_state_bytes)
if(NOT no_state)
  math(EXPR last "${ranks} - 1")
  foreach(r RANGE ${last})
    string(JSON got GET "${measured}" state_bytes ${r})
    string(JSON want GET "${measured}" predicted_state_bytes ${r})
    if(NOT got EQUAL want)
      message(FATAL_ERROR "check-predicted: rank ${r} kept ${got} bytes of model state, "
                          "predicted ${want} (${MEASURED})")
    endif()
  endforeach()
  list(APPEND checked "model state")
endif()
# The matmul FLOPs of the first training step (chapter 02's counter) against predicted_flops,
# rank by rank, or under expert parallelism summed over the ranks (each computes what it was
# sent).
string(JSON ranks ERROR_VARIABLE no_flops LENGTH "${measured}" predicted_matmul_flops)
if(NOT no_flops)
  string(JSON exact GET "${measured}" matmul_flops_exact)
  math(EXPR last "${ranks} - 1")
  set(got_sum 0)
  set(want_sum 0)
  foreach(r RANGE ${last})
    string(JSON got GET "${measured}" matmul_flops ${r})
    string(JSON want GET "${measured}" predicted_matmul_flops ${r})
    if(exact STREQUAL "each" AND NOT got EQUAL want)
      message(FATAL_ERROR "check-predicted: rank ${r} executed ${got} matmul FLOPs, predicted "
                          "${want} (${MEASURED})")
    endif()
    math(EXPR got_sum "${got_sum} + ${got}")
    math(EXPR want_sum "${want_sum} + ${want}")
  endforeach()
  if(NOT got_sum EQUAL want_sum)
    message(FATAL_ERROR "check-predicted: the ranks executed ${got_sum} matmul FLOPs, predicted "
                        "${want_sum} (${MEASURED})")
  endif()
  list(APPEND checked "matmul FLOPs (${exact})")
endif()
message("predicted = measured: ${checked}")
