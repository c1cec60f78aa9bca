# Installs the torch-free core so engines can use find_package(kvprune):
#   find_package(kvprune REQUIRED)
#   target_link_libraries(my_engine PRIVATE kvprune::core)
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

target_include_directories(kvprune_core PUBLIC $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
install(TARGETS kvprune_core EXPORT kvprune_targets ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(DIRECTORY csrc/kvprune DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT kvprune_targets NAMESPACE kvprune:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/kvprune)
configure_package_config_file(cmake/kvprune-config.cmake.in
  "${CMAKE_CURRENT_BINARY_DIR}/kvprune-config.cmake"
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/kvprune)
write_basic_package_version_file("${CMAKE_CURRENT_BINARY_DIR}/kvprune-config-version.cmake"
  COMPATIBILITY SameMinorVersion)
install(FILES "${CMAKE_CURRENT_BINARY_DIR}/kvprune-config.cmake"
              "${CMAKE_CURRENT_BINARY_DIR}/kvprune-config-version.cmake"
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/kvprune)
