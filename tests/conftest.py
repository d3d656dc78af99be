# Triton's CPU interpreter must be chosen before `triton` itself is imported.
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

# the repository root, so that the helpers shared with the benchmarks import as ``benchmarks.models`` /
# ``benchmarks.timm_import``
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import pytest  # noqa: E402
import torch  # noqa: E402

#: what Lightning's ``seed_everything`` leaves in ``os.environ`` (a compare job run in the test process calls it): a
#: later test's processes would inherit it and seed themselves with it (tests/processes.py drops them too)
SEED_ENV = ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    before = {k: os.environ.get(k) for k in SEED_ENV}
    yield
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


#: ``python -m pytest -m quick``: a subset to run in about a minute on 2 cores while working on the code (the rules'
#: math against their references on CPU, the command line's parsing, the layout's static checks, the docs' links,
#: names and figures); the README's command and CI run the whole suite. File -> its quick tests (None: all of
#: them); parametrizations that run the Triton interpreter are left out. tests/test_quick_subset.py checks the names.
QUICK = {
    "test_rule_attnres.py": None,
    "test_rule_mhc_lite.py": None,
    "test_compare_power.py": None,
    "test_quick_subset.py": None,
    "test_rescontroller.py": ("test_reference_is_the_spec", "test_scales_shapes_and_dtypes",
                              "test_regimes_are_what_they_claim", "test_paths_match_reference_in_every_regime",
                              "test_fp32_matches_reference", "test_mixed_dtypes_promote_like_add",
                              "test_channels_first_dim1", "test_zero_rows_stay_finite",
                              "test_nan_and_inf_propagate_per_row", "test_tiny_update_passes_through",
                              "test_oversized_update_is_pulled_to_the_cap", "test_rows_are_independent",
                              "test_module_api", "test_bad_input", "test_bad_backend_and_module_options"),
    "test_rules_registry.py": ("test_builtin_names_and_variants",
                               "test_variant_names_work_in_patch_residuals_as_in_the_cli",
                               "test_bad_options_name_the_argument", "test_register_refuses_bad_entries",
                               "test_outside_rule_works_by_name_in_patch_residuals",
                               "test_a_chain_rule_must_build_a_chain"),
    "test_layout.py": ("test_imports_run_one_way", "test_imports_run_one_way_sees_an_upward_import",
                       "test_surgery_names_no_backend", "test_every_package_folder_ships"),
    "test_cli.py": ("test_bare_command_prints_help_and_starts_no_job",
                    "test_version_names_the_installed_stack_beside_the_versions_the_suite_runs_against",
                    "test_help_starts_with_what_a_compare_user_needs",
                    "test_compare_flags_and_their_yaml_section_are_one_option",
                    "test_bad_values_stop_before_anything_runs_and_say_which",
                    "test_progress_line_names_run_method_seed_and_eta"),
    "test_readme.py": ("test_ci_reads_the_test_command_line", "test_readme_is_a_front_page",
                       "test_relative_links_point_to_existing_files_and_headings",
                       "test_prose_names_existing_modules_and_paths",
                       "test_a_quoted_figure_that_no_results_file_holds_is_caught",
                       "test_quoted_figures_are_in_the_results_files_they_come_from",
                       "test_the_readme_links_and_cites_each_rules_paper_and_citation_cff_lists_the_same",
                       "test_the_tested_versions_are_quoted_as_written_once"),
}


def is_quick(file_name: str, test_name: str, item_name: str) -> bool:
    """Whether the test ``test_name`` (its function) of ``file_name``, collected as ``item_name``, is in QUICK."""
    names = QUICK.get(file_name, ())
    return (names is None or test_name in names) and "triton" not in item_name


def pytest_collection_modifyitems(config, items):
    for item in items:
        if is_quick(item.path.name, getattr(item, "originalname", item.name), item.name):
            item.add_marker(pytest.mark.quick)
